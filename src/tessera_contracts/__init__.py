"""What the processes agree on: API names, one vocabulary, and each wire object as a typed value.

Pure and at the bottom of the layering: every process package imports it, it imports none of
them (pyproject's import-linter contracts).
"""
