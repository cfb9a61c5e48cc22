package plugin

import (
	"context"
	"time"
)

// SetSleep replaces how p waits as the broker's retry-after tells it.
func SetSleep(p *Provider, sleep func(context.Context, time.Duration) error) { p.sleep = sleep }
