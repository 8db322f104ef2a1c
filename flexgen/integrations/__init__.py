"""flexgen inside other libraries.

``flexgen.integrations.transformers.register()`` makes ``attn_implementation="flexgen"``
work in Hugging Face transformers. Each integration imports its library only when used:
``import flexgen`` never imports transformers.
"""
