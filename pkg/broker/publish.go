package broker

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"

	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/publish"
)

// fieldManager owns the broker's entry and condition in ClusterProfiles'
// status.
const fieldManager = "credbroker-broker"

// tunnelSource reports the agents of a ClusterProfile from the tunnel.
type tunnelSource struct{ b *Broker }

func (s tunnelSource) Advertised(key types.NamespacedName) ([]publish.Advertisement, int) {
	cp, err := s.b.profiles.Get(key.Namespace, key.Name)
	if err != nil {
		return nil, 0
	}
	ref := fleet.ClusterRef{NamespacedName: key, UID: cp.UID}
	ads, live := s.b.tunnel.Advertised(ref)
	out := make([]publish.Advertisement, 0, len(ads))
	for _, a := range ads {
		out = append(out, publish.Advertisement{Server: a.Server, CAData: a.CAData, Streams: a.Streams})
	}
	// An agent that advertises no server of its own and offers its API
	// server through the data path is reached through the API proxy: that
	// is its vote, beside the servers other streams advertise, so that a
	// stream advertising a server of its own cannot win the first
	// publication while the cluster's agents offer the data path (case
	// 19.5). The data path is published with the proxy's URL, and so
	// pinned: the proxy verifies the spoke API server with what is
	// published only.
	if s.b.cfg.ProxyURL != "" {
		for _, o := range s.b.tunnel.DataPaths(ref) {
			out = append(out, publish.Advertisement{
				Server: apiproxy.URL(s.b.cfg.ProxyURL, key), CAData: s.b.cfg.ProxyCAData, Streams: o.Streams,
				Extensions: []clientcmdv1.NamedExtension{apiproxy.DataPathExtension(apiproxy.DataPathConfig{
					ServerName: o.ServerName, CertificateAuthorityData: o.CAData,
				})},
			})
		}
	}
	return out, live
}

func (s tunnelSource) SpokeReadiness(key types.NamespacedName) publish.Readiness {
	cp, err := s.b.profiles.Get(key.Namespace, key.Name)
	if err != nil {
		return publish.Readiness{}
	}
	r := s.b.tunnel.SpokeReadiness(fleet.ClusterRef{NamespacedName: key, UID: cp.UID})
	return publish.Readiness{Ready: r.Ready, NotReady: r.NotReady, Message: r.Message}
}

// advertisedConflicts is the gauge of the ClusterProfiles whose agents'
// advertised servers conflict, on the replica that publishes; every
// replica exposes it, at 0 when it does not publish.
func advertisedConflicts(b *Broker) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "advertised_server_conflicts",
		Help: "ClusterProfiles whose live agent streams to this replica advertise servers or CAs that disagree with each other " +
			"or with the published access provider, or a server that is not https; 0 on a replica that does not publish.",
	}, func() float64 {
		if b.publisher == nil {
			return 0
		}
		return float64(b.publisher.Conflicts())
	})
}

// newPublisher builds the publisher of the access provider, and hooks it to
// the ClusterProfile informer; the tunnel calls it when agents come and go.
func newPublisher(cfg Config, b *Broker, client inventory.Interface) (*publish.Publisher, error) {
	p, err := publish.New(publish.Config{
		ProviderName: cfg.AccessProviderName,
		Source:       tunnelSource{b},
		Get: func(key types.NamespacedName) (*v1alpha1.ClusterProfile, error) {
			cp, err := b.profiles.Get(key.Namespace, key.Name)
			if err != nil {
				return nil, nil //nolint:nilerr // gone: nothing to publish
			}
			return cp, nil
		},
		Apply: func(ctx context.Context, key types.NamespacedName, body []byte) error {
			force := true
			_, err := client.ApisV1alpha1().ClusterProfiles(key.Namespace).Patch(ctx, key.Name, types.ApplyPatchType, body,
				metav1.PatchOptions{FieldManager: fieldManager, Force: &force}, "status")
			if apierrors.IsNotFound(err) {
				return nil
			}
			return err
		},
		DisconnectGrace:     cfg.PublishDisconnectGrace,
		ControlPlaneHealthy: cfg.PublishControlPlaneHealthy,
		FieldManager:        fieldManager,
		Log:                 cfg.Log.WithName("publish"),
	})
	if err != nil {
		return nil, err
	}
	_, err = b.informers.Apis().V1alpha1().ClusterProfiles().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { enqueueProfile(p, obj) },
		UpdateFunc: func(_, obj any) { enqueueProfile(p, obj) },
	})
	return p, err
}

func enqueueProfile(p *publish.Publisher, obj any) {
	if cp, ok := obj.(*v1alpha1.ClusterProfile); ok {
		p.Enqueue(types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name})
	}
}

// runPublisher publishes while this replica holds the Lease, and campaigns
// again when it loses it, until ctx ends.
func (b *Broker) runPublisher(ctx context.Context) error {
	return b.campaign(ctx, lease{
		namespace: b.cfg.PublishLeaseNamespace, name: b.cfg.PublishLeaseName,
		what: "publisher of access providers", grant: "deploy/components/publish-access-provider",
		lead: func(ctx context.Context) {
			var all []types.NamespacedName
			for _, obj := range b.informers.Apis().V1alpha1().ClusterProfiles().Informer().GetStore().List() {
				if cp, ok := obj.(*v1alpha1.ClusterProfile); ok {
					all = append(all, types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name})
				}
			}
			b.publisher.Run(ctx, all)
		},
	})
}
