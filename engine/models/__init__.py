"""Model definitions written here (Llama family) and their weight loaders."""
