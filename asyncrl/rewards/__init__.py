"""Reward functions (pure): rule-based verifiers. Reward endpoints (actors) call into these."""
