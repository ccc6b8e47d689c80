"""Where weights come from (``sources``) and how a model is loaded and laid out for the kernels (``model``)."""
