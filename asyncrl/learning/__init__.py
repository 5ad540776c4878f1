"""The learners' steps: policy, value and DQO updates over rows of samples, packed by a token budget."""
