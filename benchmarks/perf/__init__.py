"""Speed and memory: the platform against a baseline in the same run."""
