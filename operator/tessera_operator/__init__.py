"""Tessera operator: GPU health -> NTP layout plan -> patch into the running job."""
