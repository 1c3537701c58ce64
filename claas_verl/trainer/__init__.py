"""verl trainer and worker subclasses of claas_verl (built from verl's extension points, never a copied loop)."""
