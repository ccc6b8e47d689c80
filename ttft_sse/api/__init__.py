"""HTTP surfaces, one module each. Routes stay thin: parse, hand to ``Generations``, frame the answer."""
