package broker

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// newDataPath builds the router of the agents' data path streams, which
// every replica serves on its agent port, and, with ProxyAddress, the API
// proxy and its listener.
func (b *Broker) newDataPath() (err error) {
	var id [8]byte
	_, _ = rand.Read(id[:])
	if b.router, err = apiproxy.NewRouter(apiproxy.RouterConfig{
		Admitter:             b.tunnel,
		ServerID:             "credbroker-" + hex.EncodeToString(id[:]),
		MaxStreamsPerCluster: b.cfg.MaxStreamsPerCluster,
		Log:                  b.cfg.Log.WithName("datapath"),
	}); err != nil {
		return err
	}
	if b.cfg.ProxyAddress == "" {
		return nil
	}
	proxy, err := apiproxy.NewProxy(apiproxy.ProxyConfig{
		Dialer:                 b.router,
		Grants:                 b.grants,
		Upstreams:              upstreams{b},
		MaxRequestsPerCluster:  b.cfg.ProxyMaxRequestsPerCluster,
		MaxRequestsPerConsumer: b.cfg.ProxyMaxRequestsPerConsumer,
		ResponseHeaderTimeout:  b.cfg.ProxyResponseHeaderTimeout,
		Audit:                  b.cfg.Audit,
		Registerer:             b.registry,
	})
	if err != nil {
		return err
	}
	b.proxyServer = &http.Server{
		Handler: proxy,
		TLSConfig: &tls.Config{
			GetCertificate: b.keyPair.GetCertificate,
			MinVersion:     tls.VersionTLS12,
			NextProtos:     []string{"h2", "http/1.1"},
		},
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       b.cfg.ProxyIdleTimeout,
		MaxHeaderBytes:    64 << 10,
	}
	if b.proxyLis, err = net.Listen("tcp", b.cfg.ProxyAddress); err != nil {
		return fmt.Errorf("proxy listener: %w", err)
	}
	return nil
}

// ProxyAddr is the bound address of the API proxy; empty when it is
// disabled.
func (b *Broker) ProxyAddr() string {
	if b.proxyLis == nil {
		return ""
	}
	return b.proxyLis.Addr().String()
}

// serveProxy serves the API proxy until the drain stops it (stopProxy).
func (b *Broker) serveProxy() error {
	if err := b.proxyServer.ServeTLS(b.proxyLis, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("broker: proxy server: %w", err)
	}
	return nil
}

// stopProxy closes the API proxy's listener, lets the requests in flight
// finish for at most grace, and then closes what is left.
func (b *Broker) stopProxy(grace time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	_ = b.proxyServer.Shutdown(ctx)
	_ = b.proxyServer.Close()
}

// DataPathStreams reports how many data path streams carry the
// ClusterProfile's API server to this replica.
func (b *Broker) DataPathStreams(namespace, name string) int {
	cp, err := b.profiles.Get(namespace, name)
	if err != nil {
		return 0
	}
	return b.router.Carriers(fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID})
}

// upstreams resolves a ClusterProfile to its API server as its status
// records it (apiproxy.DataPathExtensionName), never as an agent offers it
// at the moment.
type upstreams struct{ b *Broker }

func (u upstreams) Upstream(key types.NamespacedName) (apiproxy.Upstream, error) {
	cp, err := u.b.profiles.Get(key.Namespace, key.Name)
	if err != nil {
		return apiproxy.Upstream{}, err
	}
	dp, err := apiproxy.DataPathOf(cp, u.b.cfg.AccessProviderName)
	if err != nil {
		return apiproxy.Upstream{}, fmt.Errorf("ClusterProfile %s records no data path to its API server: %v; with --publish-access-provider "+
			"and --proxy-url the broker publishes the one its agents agree on, or its cluster manager writes it: %w", key, err, errdefs.ErrUnavailable)
	}
	ref := fleet.ClusterRef{NamespacedName: key, UID: cp.UID}
	if u.b.router.Carriers(ref) == 0 {
		return apiproxy.Upstream{}, fmt.Errorf("no agent of ClusterProfile %s carries its API server to this broker: "+
			"an agent offers it when it runs without --advertise-server (or with --data-path): %w", key, errdefs.ErrUnavailable)
	}
	return apiproxy.Upstream{Cluster: ref, ServerName: dp.ServerName, CAData: dp.CertificateAuthorityData}, nil
}
