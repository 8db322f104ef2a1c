"""Turning a user's mod into an expression: the tracer, the sympy form, the lowered snippet."""
