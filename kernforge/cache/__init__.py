"""The disk cache, pre-warm and the command line."""
