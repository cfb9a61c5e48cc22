package tokenexchange

import "time"

// Defaults of Config, which New applies to the fields left zero and the
// broker's flags start from.
const (
	DefaultAudience      = "credbroker"
	DefaultMaxExpiration = time.Hour
	DefaultAuthnTTL      = 10 * time.Second
	DefaultAllowTTL      = 10 * time.Second
	DefaultDenyTTL       = 2 * time.Second
	DefaultReviewTimeout = 5 * time.Second
	DefaultCacheSize     = 10000

	// DefaultRateLimit and DefaultRateBurst: a consumer's start with 1,000
	// ClusterProfiles (1,000 SubjectAccessReviews and 1,000 mints) fits
	// the burst.
	DefaultRateLimit = 20
	DefaultRateBurst = 2000

	DefaultReviewRateLimit     = 100
	DefaultReviewBurst         = 200
	DefaultPeerReviewRateLimit = 10
	DefaultPeerReviewBurst     = 20
	// DefaultNamespaceReviewRateLimit and DefaultNamespaceReviewBurst are a
	// quarter of the broker-wide review budget, so that it takes four hub
	// namespaces flooding together to spend it.
	DefaultNamespaceReviewRateLimit = DefaultReviewRateLimit / 4
	DefaultNamespaceReviewBurst     = DefaultReviewBurst / 4
)
