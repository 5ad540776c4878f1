"""Long-lived roles of a training run, one module each: thin shells that hold state and do I/O."""
