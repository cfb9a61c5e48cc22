package plugin

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"sigs.k8s.io/cluster-inventory-api/pkg/credentialplugin"

	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/errdefs"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// DefaultTimeout bounds one exchange when Config.Timeout is zero.
const DefaultTimeout = brokerclient.DefaultTimeout

// DefaultMaxRetryWait bounds, when Config.MaxRetryWait is zero, how long
// one GetToken waits in all as the broker's retry-after tells it: with
// DefaultTimeout, a GetToken lasts at most a minute (see the package
// documentation).
const DefaultMaxRetryWait = 30 * time.Second

// Config configures a Provider.
type Config struct {
	// BrokerAddress is the broker's gRPC address, host:port; required.
	BrokerAddress string
	// TLS verifies the broker; required, and must not skip verification. It
	// is cloned by New.
	TLS *tls.Config
	// TokenFile holds the hub ServiceAccount token; required. It is read on
	// every GetToken, because the kubelet rotates it.
	TokenFile string
	// Cluster, when set, overrides the ClusterProfile named in ExecCredential
	// spec.cluster.config.
	Cluster *Reference
	// ServiceAccount is the spoke ServiceAccount to ask for; when nil, the
	// spoke agent picks the single one that allows the caller.
	ServiceAccount *Reference
	// Audiences of the spoke token; empty means the spoke API server's
	// default audiences.
	Audiences []string
	// ExpirationSeconds is the requested lifetime; zero means the broker's
	// maximum. The broker clamps other values.
	ExpirationSeconds int64
	// Timeout bounds one exchange, connection included; zero means
	// DefaultTimeout.
	Timeout time.Duration
	// MaxRetryWait bounds how long one GetToken waits, in all, when the
	// broker refuses it with ResourceExhausted and a retry-after trailer
	// (its per-consumer rate limit): GetToken waits as told, plus up to a
	// fifth more so that refused callers do not all come back at once, and
	// asks again, while the waits fit in MaxRetryWait. Zero means
	// DefaultMaxRetryWait; negative never waits. A GetToken lasts at most
	// Timeout plus MaxRetryWait.
	MaxRetryWait time.Duration
}

// Provider is a credentialplugin.Provider that gets spoke tokens from the
// broker. It is safe for concurrent use.
type Provider struct {
	cfg   Config
	creds credentials.TransportCredentials

	// sleep waits as the broker's retry-after tells; nil means a timer.
	// Tests replace it.
	sleep func(context.Context, time.Duration) error
}

var _ credentialplugin.Provider = (*Provider)(nil)

// New validates cfg and returns a Provider. It does not connect to the
// broker or read the token file; GetToken does, on every call.
func New(cfg Config) (*Provider, error) {
	if err := brokerclient.ValidateAddress(cfg.BrokerAddress); err != nil {
		return nil, err
	}
	creds, err := brokerclient.TLSCredentials(cfg.TLS)
	if err != nil {
		return nil, err
	}
	if cfg.TokenFile == "" {
		return nil, errors.New("token file is required")
	}
	if cfg.Cluster != nil {
		if err := cfg.Cluster.Validate(); err != nil {
			return nil, fmt.Errorf("cluster: %w", err)
		}
		c := *cfg.Cluster
		cfg.Cluster = &c
	}
	if cfg.ServiceAccount != nil {
		if err := cfg.ServiceAccount.Validate(); err != nil {
			return nil, fmt.Errorf("service account: %w", err)
		}
		sa := *cfg.ServiceAccount
		cfg.ServiceAccount = &sa
	}
	req, err := brokerclient.Request{Audiences: cfg.Audiences, ExpirationSeconds: cfg.ExpirationSeconds, Timeout: cfg.Timeout}.Normalize()
	if err != nil {
		return nil, err
	}
	cfg.Audiences, cfg.Timeout = req.Audiences, req.Timeout
	if cfg.MaxRetryWait == 0 {
		cfg.MaxRetryWait = DefaultMaxRetryWait
	}
	cfg.TLS = cfg.TLS.Clone()
	return &Provider{cfg: cfg, creds: creds}, nil
}

// Name returns Name.
func (p *Provider) Name() string { return Name }

// GetToken exchanges the hub token in Config.TokenFile for a token on the
// spoke named by Config.Cluster or, when that is nil, by in.Spec.Cluster.Config
// (see ParseExecConfig). A failed exchange returns an error that reads
// "exchange for cluster <ns>/<name>: <code in words>: <message>; <what to fix>"; errdefs.Code
// reports its gRPC code and errors.Is matches the errdefs sentinel. A
// refusal by the broker's rate limit that tells how long to wait (the
// "retry-after" trailer) is waited out and asked again, for
// Config.MaxRetryWait in all; the last refusal is the error when the
// next wait would not fit.
//
// The token is returned only when in.Spec.Cluster.Server, where client-go
// will send it, is the server the broker reports for that ClusterProfile,
// spelling aside (scheme and host case, default port, trailing slash), and
// in.Spec.Cluster.CertificateAuthorityData is the CA bundle the broker
// reports, surrounding white space aside (both empty is the same). Otherwise
// the error wraps errdefs.ErrPermissionDenied and names both servers, or
// both bundles by size and SHA-256. Exec info with a server that is not
// https, InsecureSkipTLSVerify, a ProxyURL, or a TLSServerName other than
// the server's host is refused the same way before any token is asked for. Without in.Spec.Cluster.Server,
// GetToken asks for no token and returns an error wrapping
// errdefs.ErrFailedPrecondition.
func (p *Provider) GetToken(ctx context.Context, in clientauthenticationv1.ExecCredential) (clientauthenticationv1.ExecCredentialStatus, error) {
	var none clientauthenticationv1.ExecCredentialStatus
	cluster, err := p.cluster(&in)
	if err != nil {
		return none, err
	}
	// client-go sends the token to spec.cluster.server. Without it there
	// is nothing to check the broker's answer against, so no token is
	// asked for.
	if in.Spec.Cluster == nil || in.Spec.Cluster.Server == "" {
		return none, fmt.Errorf("exchange for cluster %s: ExecCredential has no spec.cluster.server to check the cluster's "+
			"server against; set provideClusterInfo: true in the exec config: %w", cluster, errdefs.ErrFailedPrecondition)
	}
	if err := checkTransport(cluster, in.Spec.Cluster); err != nil {
		return none, err
	}
	hubToken, err := brokerclient.ReadToken(p.cfg.TokenFile)
	if err != nil {
		return none, err
	}
	resp, err := p.exchange(ctx, cluster, hubToken)
	if err != nil {
		return none, err
	}
	return credential(cluster, in.Spec.Cluster, resp)
}

// exchange asks the broker for a token of cluster with the consumer's
// hubToken, waiting out the refusals of its rate limit for MaxRetryWait.
func (p *Provider) exchange(ctx context.Context, cluster Reference, hubToken string) (*credbrokerv1alpha1.ExchangeResponse, error) {
	// Each exchange has Timeout; the waits a rate limit asks for add at
	// most MaxRetryWait.
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout+max(p.cfg.MaxRetryWait, 0))
	defer cancel()
	conn, err := brokerclient.Dial(p.cfg.BrokerAddress, p.creds, "credbroker-plugin")
	if err != nil {
		return nil, fmt.Errorf("exchange for cluster %s: %w", cluster, err)
	}
	defer func() { _ = conn.Close() }()

	req := &credbrokerv1alpha1.ExchangeRequest{
		Cluster:           &credbrokerv1alpha1.ObjectReference{Namespace: cluster.Namespace, Name: cluster.Name},
		Audiences:         p.cfg.Audiences,
		ExpirationSeconds: p.cfg.ExpirationSeconds,
	}
	if sa := p.cfg.ServiceAccount; sa != nil {
		req.ServiceAccount = &credbrokerv1alpha1.ObjectReference{Namespace: sa.Namespace, Name: sa.Name}
	}
	x := credbrokerv1alpha1.NewTokenExchangeClient(conn)
	return brokerclient.WaitAndRetry(ctx, p.cfg.MaxRetryWait, p.sleep, func() (*credbrokerv1alpha1.ExchangeResponse, time.Duration, error) {
		ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
		defer cancel()
		var trailer metadata.MD
		resp, err := x.Exchange(ctx, req, grpc.PerRPCCredentials(brokerclient.Bearer(hubToken)), grpc.Trailer(&trailer))
		if err != nil {
			wait, _ := brokerclient.RetryAfter(err, trailer)
			return nil, wait, p.exchangeError(cluster, err, hubToken)
		}
		return resp, 0, nil
	})
}

// credential returns the credential of the broker's answer resp for
// cluster, once it has a token and a valid expiry and names the server and
// CA of exec, where client-go sends the token.
func credential(cluster Reference, exec *clientauthenticationv1.Cluster, resp *credbrokerv1alpha1.ExchangeResponse) (clientauthenticationv1.ExecCredentialStatus, error) {
	var none clientauthenticationv1.ExecCredentialStatus
	if resp.GetToken() == "" {
		return none, fmt.Errorf("exchange for cluster %s: broker returned no token", cluster)
	}
	exp := resp.GetExpirationTime()
	if exp == nil {
		return none, fmt.Errorf("exchange for cluster %s: broker returned no expiration time", cluster)
	}
	if err := exp.CheckValid(); err != nil {
		return none, fmt.Errorf("exchange for cluster %s: broker returned an invalid expiration time: %w", cluster, err)
	}
	if err := sameServer(cluster, exec.Server, resp.GetServer()); err != nil {
		return none, err
	}
	if err := sameCA(cluster, exec.Server, exec.CertificateAuthorityData, resp.GetCertificateAuthorityData()); err != nil {
		return none, err
	}
	expiry := metav1.NewTime(exp.AsTime().UTC())
	return clientauthenticationv1.ExecCredentialStatus{
		Token:               resp.GetToken(),
		ExpirationTimestamp: &expiry,
	}, nil
}

// cluster picks the ClusterProfile: Config.Cluster, else spec.cluster.config.
func (p *Provider) cluster(in *clientauthenticationv1.ExecCredential) (Reference, error) {
	if p.cfg.Cluster != nil {
		return *p.cfg.Cluster, nil
	}
	var raw []byte
	if c := in.Spec.Cluster; c != nil {
		raw = c.Config.Raw
		if len(raw) == 0 && c.Config.Object != nil {
			b, err := json.Marshal(c.Config.Object)
			if err != nil {
				return Reference{}, fmt.Errorf("encode ExecCredential spec.cluster.config: %w", err)
			}
			raw = b
		}
	}
	if r := bytes.TrimSpace(raw); len(r) == 0 || string(r) == "null" {
		return Reference{}, errors.New("no ClusterProfile to get a token for: set the cluster to use " +
			"(--cluster <namespace>/<name>), or set clusterProfile in the \"client.authentication.k8s.io/exec\" " +
			"extension of the ClusterProfile's " + Name + " access provider and provideClusterInfo: true in the exec config")
	}
	ec, err := ParseExecConfig(raw)
	if err != nil {
		return Reference{}, fmt.Errorf("ExecCredential spec.cluster.config: %w", err)
	}
	return *ec.ClusterProfile, nil
}

// exchangeError turns a failed Exchange into an error that names the
// cluster and, in one line (brokerclient.ExplainStatus), the code in words,
// the message and what to fix, with the hub token redacted should the
// message ever carry it. It wraps errdefs.FromCode, so errdefs.Code and
// errors.Is with the errdefs sentinels see the broker's code.
func (p *Provider) exchangeError(cluster Reference, err error, hubToken string) error {
	st := status.Convert(err)
	msg := strings.ReplaceAll(st.Message(), hubToken, "[redacted]")
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded:
		msg = fmt.Sprintf("%s (broker %s, timeout %v)", msg, p.cfg.BrokerAddress, p.cfg.Timeout)
	}
	return fmt.Errorf("exchange for cluster %s: %w", cluster, errdefs.FromCode(st.Code(), brokerclient.ExplainStatus(st.Code(), msg)))
}
