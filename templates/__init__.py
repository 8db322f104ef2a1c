"""Kernel templates. This folder is a package only so that it ships inside the wheel."""
