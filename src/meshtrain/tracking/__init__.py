"""MLflow: the run's plan, metrics and pictures, and sweeps compared side by side."""
