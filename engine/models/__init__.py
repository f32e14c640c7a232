"""Model definitions written here (the Llama layout, Gemma 2/3) and their weight loaders."""
