"""Tooling around the recipe, apart from it: figures, the end-of-run summary, the fault soak, the tiny model
builder and the TensorBoard reader."""
