"""Images in, text out: the plain data a multimodal request carries (inputs.py) and the per-family
processor adapters that make it in the API process (processors/). See README.md in this folder."""
