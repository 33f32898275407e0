"""The engine's weights as desired state: what it holds (its digest, observed from the bytes)."""
