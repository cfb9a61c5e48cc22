package brokerclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/credbroker/credbroker/pkg/token"
)

// ValidateAddress checks that addr is host:port with a host and a port in
// 1..65535.
func ValidateAddress(addr string) error {
	if addr == "" {
		return errors.New("broker address is required")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("broker address %q is not host:port: %w", addr, err)
	}
	if host == "" {
		return fmt.Errorf("broker address %q has no host", addr)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("broker address %q has an invalid port", addr)
	}
	return nil
}

// serviceConfig spreads calls over every address the broker's name resolves
// to (a headless Service names every replica) and retries a call once when
// it fails with Unavailable, as it does while a replica drains or restarts:
// gRPC sends the retry to another replica when there is one. Every call of
// the broker's services may be repeated: an exchange mints or serves a
// token, a list reads, and a revoke of what is gone already succeeds.
// ResourceExhausted is not retried: gRPC's retry policy would retry after
// its own backoff, before the wait the broker asks for (the "retry-after"
// trailer, errdefs.RetryAfterKey), and spend the consumer's budget again.
// The refusal reaches the caller, whose message names the wait; pkg/client
// and the plugin wait that long and ask again (WaitAndRetry).
const serviceConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "methodConfig": [{
    "name": [{"service": "credbroker.v1alpha1.TokenExchange"}, {"service": "credbroker.v1alpha1.Grants"}],
    "retryPolicy": {
      "maxAttempts": 2,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

// Dial returns a client connection to the broker at address (host:port)
// over creds; it connects lazily, on the first call. The dns scheme is
// explicit so that a host name is never taken for a URL scheme
// ("broker:443"). Calls go round robin over the addresses the name
// resolves to, and a call that fails with Unavailable is tried once more.
func Dial(address string, creds credentials.TransportCredentials, userAgent string) (*grpc.ClientConn, error) {
	if err := ValidateAddress(address); err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient("dns:///"+address, grpc.WithTransportCredentials(creds), grpc.WithUserAgent(userAgent),
		grpc.WithDefaultServiceConfig(serviceConfig))
	if err != nil {
		return nil, fmt.Errorf("broker %s: %w", address, err)
	}
	return conn, nil
}

// TLSCredentials returns the transport credentials that verify the broker
// with cfg, which must not skip verification. cfg is cloned.
func TLSCredentials(cfg *tls.Config) (credentials.TransportCredentials, error) {
	if cfg == nil {
		return nil, errors.New("TLS config for the broker is required")
	}
	if cfg.InsecureSkipVerify {
		return nil, errors.New("TLS config must verify the broker: InsecureSkipVerify is not allowed")
	}
	return credentials.NewTLS(cfg.Clone()), nil
}

// LoadCAFile reads the PEM CA certificates that verify the broker.
func LoadCAFile(name string) (*x509.CertPool, error) {
	pemData, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		return nil, fmt.Errorf("%s holds no PEM certificate", name)
	}
	return pool, nil
}

// ReadToken reads the hub token from the file name.
func ReadToken(name string) (string, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", fmt.Errorf("read hub token: %w", err)
	}
	defer func() { _ = f.Close() }()
	return ReadTokenFrom(f, name)
}

// ReadTokenFrom reads a hub token from r, which name describes in errors:
// one bearer token of printable ASCII, with surrounding white space.
// Errors never hold what was read.
func ReadTokenFrom(r io.Reader, name string) (string, error) {
	// Allow for some surrounding white space; anything larger is not a token.
	const limit = token.MaxLength + 1024
	b, err := io.ReadAll(io.LimitReader(r, limit))
	if err != nil {
		return "", fmt.Errorf("read hub token from %s: %w", name, err)
	}
	s := strings.TrimSpace(string(b))
	switch {
	case s == "":
		return "", fmt.Errorf("hub token file %s is empty", name)
	case len(b) == limit || len(s) > token.MaxLength:
		return "", fmt.Errorf("hub token file %s holds more than %d bytes", name, token.MaxLength)
	case strings.IndexFunc(s, func(r rune) bool { return r <= ' ' || r > '~' }) >= 0:
		return "", fmt.Errorf("hub token file %s does not hold a bearer token: it has spaces or characters that are not printable ASCII", name)
	}
	return s, nil
}

// Bearer returns per-RPC credentials that send hubToken as
// "authorization: Bearer <token>", and only over a secure transport.
func Bearer(hubToken string) credentials.PerRPCCredentials { return bearer{token: hubToken} }

type bearer struct{ token string }

func (b bearer) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	ri, _ := credentials.RequestInfoFromContext(ctx)
	if err := credentials.CheckSecurityLevel(ri.AuthInfo, credentials.PrivacyAndIntegrity); err != nil {
		return nil, fmt.Errorf("refusing to send the hub token over this connection: %w", err)
	}
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (bearer) RequireTransportSecurity() bool { return true }

// String and GoString keep the token out of any formatted output.
func (bearer) String() string   { return "bearer([redacted])" }
func (bearer) GoString() string { return "bearer([redacted])" }

// DefaultTimeout bounds one exchange when a client's Timeout is zero.
const DefaultTimeout = 30 * time.Second

// Request is what a client asks of every exchange, as its Config says.
type Request struct {
	Audiences         []string
	ExpirationSeconds int64
	// Timeout bounds one exchange; zero means DefaultTimeout.
	Timeout time.Duration
}

// Normalize checks r: audiences that are neither empty nor padded with
// spaces, a lifetime that is not negative (zero lets the broker choose),
// and a timeout that is not negative. It returns r with its own copy of
// the audiences and the timeout defaulted.
func (r Request) Normalize() (Request, error) {
	for _, a := range r.Audiences {
		if a == "" || strings.TrimSpace(a) != a {
			return r, fmt.Errorf("audience %q is empty or has surrounding spaces", a)
		}
	}
	switch {
	case r.ExpirationSeconds < 0:
		return r, fmt.Errorf("expiration seconds %d is negative", r.ExpirationSeconds)
	case r.Timeout < 0:
		return r, fmt.Errorf("timeout %v is negative", r.Timeout)
	case r.Timeout == 0:
		r.Timeout = DefaultTimeout
	}
	r.Audiences = slices.Clone(r.Audiences)
	return r, nil
}
