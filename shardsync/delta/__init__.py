"""Delta sync: send only the elements that changed since the engine's version."""
