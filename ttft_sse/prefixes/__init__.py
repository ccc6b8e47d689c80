"""Prompts computed into the prefix cache ahead of their requests: prefills, warm prompts."""
