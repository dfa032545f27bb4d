"""Model families, looked up by HF architecture name through `registry`."""
