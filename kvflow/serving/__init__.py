"""Serving layer shared by the HTTP API and the controller: the Backend interface."""
