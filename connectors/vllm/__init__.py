"""tierkv as a vLLM v1 KV connector (DESIGN section 11)."""
