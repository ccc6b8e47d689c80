"""transformers glue: what the engines hand the library and take from it, through one facade."""
