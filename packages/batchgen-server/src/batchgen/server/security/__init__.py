"""Who may call the API and what they may send: API-key authentication and input limits."""
