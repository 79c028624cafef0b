"""HTTP routers: thin, they authorize, call one service method and shape the response."""
