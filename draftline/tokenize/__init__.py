"""tokenize's library: conversations, chat rendering and masks, sources, draft vocab."""
