"""Small shared helpers: the extension registry and device selection."""
