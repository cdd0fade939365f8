"""Dataset formats, chat templates, tokenisation, collation, packing and tool schemas."""
