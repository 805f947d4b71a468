"""User-side tools above api, hooks and accuracy: the opband CLI, the HTTP client, the CI gate and the demo."""
