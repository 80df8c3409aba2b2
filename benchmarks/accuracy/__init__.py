"""Is the answer right: the model-level differential fuzz against CP = 1 (``model_fuzz``) and
bf16 rounding error against single-device attention (``bf16``)."""
