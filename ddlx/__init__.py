"""ddlx: distributed deep-learning strategy measurement and recommendation."""
