"""The HTTP server (OpenAI-compatible) and `pymoe bench`, its load generator."""
