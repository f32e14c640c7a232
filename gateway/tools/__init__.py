"""Tool-call formats: one file per format (a ToolFormat with its parser), registered in
registry.py; parsing.py holds what the parsers share, prompt.py renders tools into prompts."""
