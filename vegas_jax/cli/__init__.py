"""What the command lines share: every flag's environment variable, and output files tried before the work."""
