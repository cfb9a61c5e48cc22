package client

import (
	"context"
	"time"
)

// SetSleep replaces how c waits as the broker's retry-after tells it.
func SetSleep(c *Client, sleep func(context.Context, time.Duration) error) { c.sleep = sleep }
