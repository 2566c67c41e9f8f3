"""Science checks: numerics and quality of the recipe on real and synthetic teachers."""
