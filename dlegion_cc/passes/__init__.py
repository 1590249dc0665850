"""Graph passes: each recognizes one source construct and rewrites it (one pass per file)."""
