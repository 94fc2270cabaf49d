"""Offline evaluation (`python -m primejax.eval`) of a broadcast or HF directory."""
