"""One module per API family beyond OpenAI chat and completions (Anthropic Messages, ...)."""
