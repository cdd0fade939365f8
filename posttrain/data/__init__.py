"""Dataset formats, chat templates, tokenisation, collation and packing."""
