"""Tessera node power agent: raises and restores GPU power limits within a rack budget."""
