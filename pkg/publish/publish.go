package publish

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/time/rate"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

const (
	// ConditionType is the ClusterProfile condition the broker keeps.
	ConditionType = "CredentialBrokerConnected"
	// ReasonAgentConnected and ReasonNoAgentConnected are its reasons.
	ReasonAgentConnected   = "AgentConnected"
	ReasonNoAgentConnected = "NoAgentConnected"
	// HealthConditionType is the condition that multicluster-runtime's
	// cluster-inventory-api provider, among others, gates on; the broker
	// keeps it only with Config.ControlPlaneHealthy.
	HealthConditionType = v1alpha1.ClusterConditionControlPlaneHealthy
	// ReasonSpokeReady, ReasonSpokeNotReady and ReasonNotReported are its
	// reasons, besides ReasonNoAgentConnected.
	ReasonSpokeReady    = "SpokeAPIServerReady"
	ReasonSpokeNotReady = "SpokeAPIServerNotReady"
	ReasonNotReported   = "SpokeHealthNotReported"
	// ExecExtensionName is the cluster extension that cluster-inventory-api's
	// pkg/access hands to the exec plugin as ExecCredential spec.cluster.config.
	ExecExtensionName = "client.authentication.k8s.io/exec"
)

// Advertisement is one server URL and CA that live agent streams of a
// ClusterProfile advertised in their hellos, and how many streams did.
type Advertisement struct {
	Server string
	CAData []byte
	// Extensions, beside the exec extension, are published with them,
	// such as the data path of a spoke reached through the API proxy.
	Extensions []clientcmdv1.NamedExtension
	Streams    int
}

// Source tells what the agents of a ClusterProfile advertised: every
// distinct server and CA of its live streams (none when no stream
// advertised one), and how many streams are live, those that advertise
// nothing included. The broker passes its tunnel server.
type Source interface {
	Advertised(key types.NamespacedName) (ads []Advertisement, live int)
	// SpokeReadiness counts the live streams of a ClusterProfile by what
	// their agents last reported of the spoke API server's /readyz.
	SpokeReadiness(key types.NamespacedName) Readiness
}

// Readiness counts a ClusterProfile's live agent streams by what their
// agents last reported of the spoke API server's /readyz.
type Readiness struct {
	// Ready and NotReady count the streams whose agents reported the spoke
	// ready, and not ready; the others reported nothing.
	Ready, NotReady int
	// Message says why a not ready spoke is not ready.
	Message string
}

// Config configures a Publisher.
type Config struct {
	// ProviderName names the access provider entry the publisher owns.
	ProviderName string
	// Source reports the connected agents; required.
	Source Source
	// Get returns the cached ClusterProfile, or nil when there is none;
	// required.
	Get func(key types.NamespacedName) (*v1alpha1.ClusterProfile, error)
	// Apply server-side-applies body (a ClusterProfile with only what the
	// publisher owns) to the status of the named ClusterProfile; required.
	Apply func(ctx context.Context, key types.NamespacedName, body []byte) error
	// DisconnectGrace is how long a ClusterProfile must have no agent
	// before the condition turns False, counted from the loss or from the
	// start of Run, whichever is later: agents that reconnect in time, or
	// that have not yet reached a new leader, cause no write.
	DisconnectGrace time.Duration
	// RateLimiter paces the writes. Default: per ClusterProfile an
	// exponential backoff after failures (100ms to 5m), and for all of them
	// together 10 writes a second with a burst of 100.
	RateLimiter workqueue.TypedRateLimiter[types.NamespacedName]
	// Clock times the grace. Default: the real clock.
	Clock clock.Clock
	Log   logr.Logger
	// ControlPlaneHealthy makes the publisher keep the ControlPlaneHealthy
	// condition too, from the agents' reports of the spoke's /readyz, on
	// every ClusterProfile where no field manager other than FieldManager
	// owns it.
	ControlPlaneHealthy bool
	// FieldManager is the field manager that Apply writes as; required
	// with ControlPlaneHealthy.
	FieldManager string
}

// Publisher keeps the broker's access provider entry and condition on the
// ClusterProfiles whose agents are connected. Build it with New; Run it on
// the replica that holds the lease.
type Publisher struct {
	cfg Config

	mu      sync.Mutex
	queue   workqueue.TypedRateLimitingInterface[types.NamespacedName] // nil when not running
	started time.Time
	lostAt  map[types.NamespacedName]time.Time
	// conflicts holds, for each ClusterProfile whose advertisements are in
	// conflict, the last conflict logged.
	conflicts map[types.NamespacedName]string
}

// New checks cfg and returns a Publisher that is not running.
func New(cfg Config) (*Publisher, error) {
	if cfg.ProviderName == "" || cfg.Source == nil || cfg.Get == nil || cfg.Apply == nil {
		return nil, errors.New("publish: ProviderName, Source, Get and Apply are required")
	}
	if cfg.ControlPlaneHealthy && cfg.FieldManager == "" {
		return nil, errors.New("publish: keeping ControlPlaneHealthy needs the field manager that Apply writes as")
	}
	if cfg.DisconnectGrace < 0 {
		return nil, errors.New("publish: the disconnect grace must not be negative")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &Publisher{cfg: cfg, lostAt: map[types.NamespacedName]time.Time{}, conflicts: map[types.NamespacedName]string{}}, nil
}

func (p *Publisher) rateLimiter() workqueue.TypedRateLimiter[types.NamespacedName] {
	if p.cfg.RateLimiter != nil {
		return p.cfg.RateLimiter
	}
	return workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](100*time.Millisecond, 5*time.Minute),
		&workqueue.TypedBucketRateLimiter[types.NamespacedName]{Limiter: rate.NewLimiter(10, 100)},
	)
}

// Enqueue asks for the ClusterProfile to be looked at again. It does
// nothing while the publisher is not running: Run looks at every one.
func (p *Publisher) Enqueue(key types.NamespacedName) {
	p.mu.Lock()
	q := p.queue
	p.mu.Unlock()
	if q != nil {
		q.AddRateLimited(key)
	}
}

// Run publishes until ctx ends, starting with every key of all.
func (p *Publisher) Run(ctx context.Context, all []types.NamespacedName) {
	q := workqueue.NewTypedRateLimitingQueueWithConfig(p.rateLimiter(), workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: "credbroker-publish"})
	p.mu.Lock()
	p.queue, p.started = q, p.cfg.Clock.Now()
	clear(p.lostAt)
	clear(p.conflicts)
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.queue = nil
		clear(p.conflicts) // another replica judges them now
		p.mu.Unlock()
	}()
	for _, k := range all {
		q.AddRateLimited(k)
	}
	go func() {
		<-ctx.Done()
		q.ShutDown()
	}()
	for {
		key, quit := q.Get()
		if quit {
			return
		}
		after, err := p.Reconcile(ctx, key)
		switch {
		case err != nil:
			p.cfg.Log.Info("publishing the access provider failed", "cluster", key.String(), "err", err.Error())
			q.AddRateLimited(key)
		case after > 0:
			q.Forget(key)
			q.AddAfter(key, after)
		default:
			q.Forget(key)
		}
		q.Done(key)
	}
}

// Reconcile compares what the ClusterProfile's status says with what the
// agents report, and applies the difference. It returns when to look
// again, if the answer depends on the grace.
func (p *Publisher) Reconcile(ctx context.Context, key types.NamespacedName) (time.Duration, error) {
	cp, err := p.cfg.Get(key)
	if err != nil {
		return 0, fmt.Errorf("clusterprofile %s: %w", key, err)
	}
	if cp == nil || cp.DeletionTimestamp != nil {
		p.forget(key)
		p.noteConflict(key, verdict{}, nil)
		return 0, nil
	}
	ads, live := p.cfg.Source.Advertised(key)
	entry, cond := p.observed(cp)
	v := decide(entry, ads)
	p.noteConflict(key, v, ads)

	var want *v1alpha1.AccessProvider
	var status metav1.ConditionStatus
	var reason, message string
	if live > 0 {
		p.forget(key)
		status, reason = metav1.ConditionTrue, ReasonAgentConnected
		message = "An agent of this cluster is connected to credbroker."
		if v.server != "" {
			want = p.entry(key, v.server, v.caData, v.extensions)
		}
		switch {
		case v.conflict == conflictPinned:
			message += " Its agents disagree with the published server or CA, or with each other; the published entry stays until an admin removes it."
		case v.conflict == conflictAgents:
			message += " Its agents disagree on the server or CA they advertise, so no access provider is published until they all agree."
		case v.conflict == conflictRefused && want == nil:
			message += " It advertises a server that is not an https URL with a host, which is never published."
		case want == nil:
			message += " It advertises no server, so no access provider is published."
		}
	} else {
		if entry == nil && cond == nil {
			return 0, nil // never published: nothing to say
		}
		if wait := p.graceLeft(key); wait > 0 {
			return wait, nil
		}
		status, reason = metav1.ConditionFalse, ReasonNoAgentConnected
		message = "No agent of this cluster is connected to credbroker; exchanges fail with Unavailable until one is."
		if v.server != "" {
			want = entry // the last server and CA stay; the condition says they do not work now
		}
	}
	connected := metav1.Condition{Type: ConditionType, Status: status, Reason: reason, Message: message}
	health, dropHealth := p.healthCondition(cp, live, key)
	if sameEntry(entry, want) && sameCondition(cond, connected, cp.Generation) &&
		(health == nil || sameCondition(findCondition(cp, HealthConditionType), *health, cp.Generation)) && !dropHealth {
		return 0, nil
	}
	body := applyBody{
		APIVersion: v1alpha1.GroupVersion.String(),
		Kind:       "ClusterProfile",
		Metadata:   applyMeta{Namespace: key.Namespace, Name: key.Name},
	}
	if want != nil {
		body.Status.AccessProviders = []v1alpha1.AccessProvider{*want}
	}
	body.Status.Conditions = []metav1.Condition{p.stamp(cond, connected, cp.Generation)}
	if health != nil {
		body.Status.Conditions = append(body.Status.Conditions, p.stamp(findCondition(cp, HealthConditionType), *health, cp.Generation))
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return 0, fmt.Errorf("clusterprofile %s: %w", key, err)
	}
	if err := p.cfg.Apply(ctx, key, raw); err != nil {
		return 0, fmt.Errorf("clusterprofile %s: apply status: %w", key, err)
	}
	p.cfg.Log.V(1).Info("access provider published", "cluster", key.String(), "condition", string(status), "server", clipURL(v.server))
	return 0, nil
}

// applyBody is a ClusterProfile with only the fields the publisher owns.
type applyBody struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Metadata   applyMeta `json:"metadata"`
	Status     struct {
		AccessProviders []v1alpha1.AccessProvider `json:"accessProviders,omitempty"`
		Conditions      []metav1.Condition        `json:"conditions"`
	} `json:"status"`
}

type applyMeta struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

func (p *Publisher) entry(key types.NamespacedName, server string, caData []byte, extra []clientcmdv1.NamedExtension) *v1alpha1.AccessProvider {
	ext, _ := json.Marshal(map[string]any{"clusterProfile": map[string]string{"namespace": key.Namespace, "name": key.Name}})
	return &v1alpha1.AccessProvider{Name: p.cfg.ProviderName, Cluster: clientcmdv1.Cluster{
		Server:                   server,
		CertificateAuthorityData: caData,
		Extensions:               append([]clientcmdv1.NamedExtension{{Name: ExecExtensionName, Extension: runtime.RawExtension{Raw: ext}}}, extra...),
	}}
}

// extraExtensions returns the extensions of entry other than the exec
// extension, which the publisher writes itself.
func extraExtensions(entry *v1alpha1.AccessProvider) []clientcmdv1.NamedExtension {
	var out []clientcmdv1.NamedExtension
	for _, e := range entry.Cluster.Extensions {
		if e.Name != ExecExtensionName {
			out = append(out, e)
		}
	}
	return out
}

// sameExtensions compares two lists of extensions, by name and JSON.
func sameExtensions(a, b []clientcmdv1.NamedExtension) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Name != b[i].Name || !sameJSON(a[i].Extension.Raw, b[i].Extension.Raw) {
			return false
		}
	}
	return true
}

// observed returns the publisher's entry and condition in cp's status.
func (p *Publisher) observed(cp *v1alpha1.ClusterProfile) (*v1alpha1.AccessProvider, *metav1.Condition) {
	var entry *v1alpha1.AccessProvider
	for i := range cp.Status.AccessProviders {
		if cp.Status.AccessProviders[i].Name == p.cfg.ProviderName {
			entry = &cp.Status.AccessProviders[i]
		}
	}
	return entry, findCondition(cp, ConditionType)
}

// findCondition returns cp's condition of type t, or nil.
func findCondition(cp *v1alpha1.ClusterProfile, t string) *metav1.Condition {
	for i := range cp.Status.Conditions {
		if cp.Status.Conditions[i].Type == t {
			return &cp.Status.Conditions[i]
		}
	}
	return nil
}

// sameCondition reports whether have says what want says, for generation.
func sameCondition(have *metav1.Condition, want metav1.Condition, generation int64) bool {
	return have != nil && have.Status == want.Status && have.Reason == want.Reason &&
		have.Message == want.Message && have.ObservedGeneration == generation
}

// stamp completes want with the generation and its transition time: have's
// when the status did not change, and now when it did.
func (p *Publisher) stamp(have *metav1.Condition, want metav1.Condition, generation int64) metav1.Condition {
	want.ObservedGeneration = generation
	want.LastTransitionTime = metav1.NewTime(p.cfg.Clock.Now())
	if have != nil && have.Status == want.Status {
		want.LastTransitionTime = have.LastTransitionTime
	}
	return want
}

// sameEntry compares the fields the publisher writes.
func sameEntry(a, b *v1alpha1.AccessProvider) bool {
	if a == nil || b == nil {
		return a == b
	}
	if a.Cluster.Server != b.Cluster.Server || !bytes.Equal(a.Cluster.CertificateAuthorityData, b.Cluster.CertificateAuthorityData) ||
		len(a.Cluster.Extensions) != len(b.Cluster.Extensions) {
		return false
	}
	for i, x := range a.Cluster.Extensions {
		y := b.Cluster.Extensions[i]
		if x.Name != y.Name || !sameJSON(x.Extension.Raw, y.Extension.Raw) {
			return false
		}
	}
	return true
}

func sameJSON(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	ja, _ := json.Marshal(x)
	jb, _ := json.Marshal(y)
	return bytes.Equal(ja, jb)
}

// graceLeft records when key was first seen without an agent and returns
// how much of the grace remains.
func (p *Publisher) graceLeft(key types.NamespacedName) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.cfg.Clock.Now()
	lost, ok := p.lostAt[key]
	if !ok {
		lost = now
		p.lostAt[key] = now
	}
	if p.started.After(lost) {
		lost = p.started
	}
	return lost.Add(p.cfg.DisconnectGrace).Sub(now)
}

// forget drops the loss time of key.
func (p *Publisher) forget(key types.NamespacedName) {
	p.mu.Lock()
	delete(p.lostAt, key)
	p.mu.Unlock()
}
