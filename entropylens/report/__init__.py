"""What a user sees: the report's figures and captions, the token viewer, `show` and `watch`."""
