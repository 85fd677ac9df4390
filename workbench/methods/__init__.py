"""One module per paper: the method itself, small and readable. Nothing else imports these."""
