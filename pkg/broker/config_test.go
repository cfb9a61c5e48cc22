package broker

import (
	"math"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"k8s.io/client-go/rest"
)

func TestValidate(t *testing.T) {
	valid := func() Config {
		c := Default()
		c.TLSCertFile, c.TLSKeyFile = "tls.crt", "tls.key"
		c.SVIDCertFile, c.SVIDKeyFile, c.TrustBundleFile = "svid.crt", "svid.key", "bundle.crt"
		c.TrustDomain = spiffeid.RequireTrustDomainFromString("fleet.example")
		c.Hub = &rest.Config{Host: "https://hub"}
		return c
	}
	tests := []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{name: "defaults and files", mutate: func(*Config) {}},
		{name: "nothing chosen", mutate: func(c *Config) { *c = Default() }, want: "a TLS certificate and key for the exchange port are required\n" +
			"an SVID source is required: the Workload API socket (--spiffe-endpoint-socket), " +
			"or an SVID certificate, key and trust bundle (--svid-cert-file, --svid-key-file, --trust-bundle-file)\nthe trust domain is required\na hub client config is required"},
		{name: "short max expiration", mutate: func(c *Config) { c.MaxExpiration = 5 * time.Minute },
			want: "the maximum expiration must be at least 10m (TokenRequest's floor), got 5m0s"},
		{name: "denials cached longer", mutate: func(c *Config) { c.DenyTTL = time.Minute },
			want: "denials must not be cached longer than approvals (1m0s > 10s)"},
		{name: "client-go default QPS", mutate: func(c *Config) { c.HubQPS = 0 }, want: "hub QPS and burst must be positive and finite"},
		{name: "no per-peer review limit", mutate: func(c *Config) { c.PeerReviewBurst = 0 },
			want: "the per-peer review rate limit and burst must be positive and finite"},
		{name: "no per-namespace review limit", mutate: func(c *Config) { c.NamespaceReviewBurst = 0 },
			want: "the per-namespace review rate limit and burst must be positive and finite"},
		{name: "an infinite per-namespace review limit", mutate: func(c *Config) { c.NamespaceReviewRateLimit = math.Inf(1) },
			want: "the per-namespace review rate limit and burst must be positive and finite"},
		{name: "infinite rates switch limiters off", mutate: func(c *Config) {
			c.HubQPS, c.RateLimit, c.ReviewRateLimit, c.PeerReviewRateLimit = float32(math.Inf(1)), math.Inf(1), math.Inf(1), math.Inf(1)
		}, want: "hub QPS and burst must be positive and finite\nthe rate limit and burst must be positive and finite\n" +
			"the review rate limit and burst must be positive and finite\nthe per-peer review rate limit and burst must be positive and finite"},
		{name: "not a number", mutate: func(c *Config) { c.RateLimit = math.NaN() },
			want: "the rate limit and burst must be positive and finite"},
		{name: "issuer keys refreshed faster than allowed", mutate: func(c *Config) { c.IssuerKeysRefresh = time.Second },
			want: "the issuer keys' minimum refresh interval must be positive and at most their refresh interval (15s, 1s)"},
		{name: "no grant sweep", mutate: func(c *Config) { c.GrantRecheckInterval = 0 },
			want: "the grant recheck interval must be positive"},
		{name: "RBAC debounce past its maximum", mutate: func(c *Config) { c.RBACDebounce = 10 * time.Second },
			want: "the RBAC debounce must be positive and at most its maximum (10s, 5s)"},
		{name: "no RBAC debounce", mutate: func(c *Config) { c.RBACDebounce = 0 },
			want: "the RBAC debounce must be positive and at most its maximum (0s, 5s)"},
		{name: "keepalive outlasts the mint timeout", mutate: func(c *Config) { c.MintTimeout, c.AgentMaxConnectionAgeGrace = 8*time.Second, time.Minute },
			want: "the agent keepalive time and timeout (5s + 3s) must add up to less than the mint timeout (8s), so that a partitioned agent's stream closes before the mints on it time out"},
		{name: "grant reviews unlimited", mutate: func(c *Config) { c.GrantReviewRateLimit = math.Inf(1) },
			want: "the grant review rate limit and burst must be positive and finite"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid()
			tt.mutate(&c)
			err := c.Validate()
			if tt.want == "" {
				assert.NoError(t, err)
				return
			}
			assert.EqualError(t, err, tt.want)
		})
	}
}
