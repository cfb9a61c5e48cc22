package broker

import (
	"fmt"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/internal/probe"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/publish"
)

// agentsArrived holds once the agents of the fleet have had their chance
// to find this replica, so that the Service does not send it consumers
// whose clusters it cannot serve yet: AgentReconnectWindow has passed
// since Run started, or, before that, every ClusterProfile that the
// replica publishing the access provider reports connected
// (CredentialBrokerConnected True) has an agent stream here. Once it
// holds, it holds: an agent that leaves later makes the replica no less
// ready than its peers.
func (b *Broker) agentsArrived() error {
	if b.arrived.Load() {
		return nil
	}
	started := b.started.Load()
	if started == nil {
		return fmt.Errorf("the agent port is not serving yet")
	}
	window := b.cfg.AgentReconnectWindow
	if b.cfg.Clock.Since(*started) >= window {
		b.arrived.Store(true)
		return nil
	}
	// The condition, which a publishing replica keeps, tells which agents
	// to wait for; with no ClusterProfile carrying it, True or False, only
	// the window does.
	var (
		waiting []types.NamespacedName
		seen    bool
	)
	for _, obj := range b.informers.Apis().V1alpha1().ClusterProfiles().Informer().GetStore().List() {
		cp, ok := obj.(*v1alpha1.ClusterProfile)
		if !ok {
			continue
		}
		seen = seen || meta.FindStatusCondition(cp.Status.Conditions, publish.ConditionType) != nil
		if cp.DeletionTimestamp != nil || !meta.IsStatusConditionTrue(cp.Status.Conditions, publish.ConditionType) {
			continue
		}
		key := types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name}
		if b.tunnel.Connected(fleet.ClusterRef{NamespacedName: key, UID: cp.UID}) == 0 {
			waiting = append(waiting, key)
		}
	}
	switch {
	case len(waiting) > 0:
		return fmt.Errorf("waiting for the agents of %d connected ClusterProfiles, such as %s, to find this replica (at most --agent-reconnect-window, %s, from the start)",
			len(waiting), waiting[0], window)
	case !seen:
		return fmt.Errorf("waiting --agent-reconnect-window (%s) from the start for the agents to find this replica: no ClusterProfile is reported connected", window)
	}
	b.arrived.Store(true)
	return nil
}

// startedNow records when the agent port started serving.
func (b *Broker) startedNow() {
	now := b.cfg.Clock.Now()
	b.started.Store(&now)
}

// Ready reports nil when the broker is ready to serve, or why not: the
// ClusterProfile informer has synced, the hub issuer's keys are loaded, its
// SVID is valid for more than probe.MinSVIDLifetime (a quarter of its
// lifetime, if that is less), the agents have had their chance to find it
// (agentsArrived), the hub answers its reads and writes of the revocation
// triggers' Lease (triggersLeaseReached), and it is not draining. /readyz
// answers it.
func (b *Broker) Ready() error {
	return probe.All(
		probe.Synced("the ClusterProfile informer has not synced", b.profiles.HasSynced),
		probe.Synced("the hub issuer's keys are not loaded", b.keys.Loaded),
		probe.SVIDValid(b.svid, b.cfg.Clock, probe.MinSVIDLifetime),
		b.agentsArrived,
		b.triggersLeaseReached,
		probe.NotDraining(&b.draining),
	)()
}

// alive answers /healthz. It takes the tunnel's session lock, which every
// mint needs: a broker wedged there times the probe out and is restarted.
func (b *Broker) alive() error {
	b.tunnel.Connected(fleet.ClusterRef{})
	return nil
}
