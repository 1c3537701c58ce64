"""Small torch-only helpers shared by every math module (no Ray, no verl)."""
