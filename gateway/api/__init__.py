"""One module per API family: its requests become engine requests; it writes its own shape."""
