package grants_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"
	inventoryinformers "sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// revoker deletes every grant it is asked to and records the ids.
type revoker struct {
	mu  sync.Mutex
	ids []string
}

func (r *revoker) Revoke(_ context.Context, _ fleet.ClusterRef, ids []string, _ string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ids = append(r.ids, ids...)
	return ids, nil
}

func (r *revoker) revoked() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(slices.Values(r.ids))
}

// brokerConfig acts on hub as the broker's ServiceAccount, with the RBAC of
// deploy/hub/rbac.yaml as shipped: the triggers need nothing more.
func brokerConfig(t *testing.T, hub *framework.Cluster) *rest.Config {
	t.Helper()
	ctx := t.Context()
	raw, err := os.ReadFile("../../deploy/hub/rbac.yaml")
	require.NoError(t, err)
	docs := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var sa *corev1.ServiceAccount
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		require.NoError(t, err)
		switch o := obj.(type) {
		case *corev1.ServiceAccount:
			require.NoError(t, hub.EnsureNamespace(ctx, o.Namespace))
			_, err = hub.Client.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
			sa = o
		case *rbacv1.ClusterRole:
			_, err = hub.Client.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = hub.Client.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.Role:
			_, err = hub.Client.RbacV1().Roles(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.RoleBinding:
			_, err = hub.Client.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("deploy/hub/rbac.yaml: no case for %T", obj)
		}
		require.NoError(t, err)
	}
	require.NotNil(t, sa)
	user, groups := framework.ServiceAccountUser(sa.Namespace, sa.Name)
	cfg := rest.CopyConfig(hub.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	return cfg
}

// The triggers against a real hub, as the broker's identity: deleting the
// RoleBinding that lets a consumer use a ClusterProfile revokes exactly that
// consumer's grant; deleting a consumer's hub ServiceAccount revokes its
// grants; deleting the ClusterProfile revokes the rest.
func TestTriggersAgainstHub(t *testing.T) {
	if os.Getenv(framework.AssetsEnv) == "" {
		t.Fatal(framework.AssetsEnv + " is not set: run make testbin and point it at the folder it prints, or run make test")
	}
	ctx := t.Context()
	env, err := framework.Start(ctx, framework.Options{})
	require.NoError(t, err, "start the hub (run make testbin)")
	t.Cleanup(func() { assert.NoError(t, env.Stop()) })
	hub := env.Hub
	asBroker := brokerConfig(t, hub)

	const fleetNS, team = "fleet", "team"
	cp, err := hub.CreateClusterProfile(ctx, fleetNS, "spoke-a", nil)
	require.NoError(t, err)
	cluster := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: fleetNS, Name: cp.Name}, UID: cp.UID}
	grantOf := func(id, name string) *pb.Grant {
		sa, err := hub.CreateServiceAccount(ctx, team, name, nil)
		require.NoError(t, err)
		require.NoError(t, hub.GrantClusterProfileToken(ctx, fleetNS, cp.Name, team, name))
		user, groups := framework.ServiceAccountUser(team, name)
		return &pb.Grant{
			CredentialId:   id,
			Cluster:        &pb.ObjectReference{Namespace: fleetNS, Name: cp.Name},
			ClusterUid:     string(cp.UID),
			Subject:        &pb.Subject{Username: user, Uid: string(sa.UID), Groups: groups},
			ExpirationTime: timestamppb.New(time.Now().Add(time.Hour)),
		}
	}
	alice, bob, carol := grantOf("JTI=alice", "alice"), grantOf("JTI=bob", "bob"), grantOf("JTI=carol", "carol")

	rev := &revoker{}
	registry, err := grants.NewRegistry(grants.RegistryConfig{Revoker: rev})
	require.NoError(t, err)
	registry.Hello(ctx, cluster, []*pb.Grant{alice, bob, carol})

	client := kubernetes.NewForConfigOrDie(asBroker)
	rbacInformers := informers.NewSharedInformerFactory(client, 0)
	rbac := rbacInformers.Rbac().V1()
	accountInformers := metadatainformer.NewSharedInformerFactory(metadata.NewForConfigOrDie(asBroker), 0)
	accounts := accountInformers.ForResource(corev1.SchemeGroupVersion.WithResource("serviceaccounts")).Informer()
	profileInformers := inventoryinformers.NewSharedInformerFactory(inventory.NewForConfigOrDie(asBroker), 0)
	profiles, err := clusterprofile.New(clusterprofile.Config{
		Informer:    profileInformers.Apis().V1alpha1().ClusterProfiles().Informer(),
		TrustDomain: spiffeid.RequireTrustDomainFromString(framework.TrustDomain),
	})
	require.NoError(t, err)
	triggers, err := grants.NewTriggers(grants.TriggersConfig{
		Grants:          registry,
		AccessReviews:   client.AuthorizationV1().SubjectAccessReviews(),
		ClusterProfiles: profiles,
		RBAC: []grants.Informer{
			rbac.Roles().Informer(), rbac.RoleBindings().Informer(),
			rbac.ClusterRoles().Informer(), rbac.ClusterRoleBindings().Informer(),
		},
		ServiceAccounts: accounts,
		Debounce:        200 * time.Millisecond,
		MaxDelay:        time.Second,
		Interval:        time.Hour,
	})
	require.NoError(t, err)
	profiles.OnChange(func(key types.NamespacedName, _ types.UID) { go triggers.ClusterProfileChanged(ctx, key) })

	runCtx, cancel := context.WithCancel(ctx)
	for _, f := range []interface{ Start(<-chan struct{}) }{rbacInformers, accountInformers, profileInformers} {
		f.Start(runCtx.Done())
	}
	done := make(chan error, 1)
	go func() { done <- triggers.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
		rbacInformers.Shutdown()
		accountInformers.Shutdown()
		profileInformers.Shutdown()
	})
	syncCtx, cancelSync := context.WithTimeout(ctx, 30*time.Second)
	defer cancelSync()
	require.True(t, cache.WaitForCacheSync(syncCtx.Done(), accounts.HasSynced, profiles.HasSynced,
		rbac.Roles().Informer().HasSynced, rbac.RoleBindings().Informer().HasSynced,
		rbac.ClusterRoles().Informer().HasSynced, rbac.ClusterRoleBindings().Informer().HasSynced),
		"the broker's identity cannot list what the triggers watch: check deploy/hub/rbac.yaml")

	live := func() []string {
		var ids []string
		for _, g := range registry.Select(grants.Selector{}) {
			ids = append(ids, g.GetCredentialId())
		}
		return ids
	}
	waitRevoked := func(want ...string) {
		t.Helper()
		require.Eventually(t, func() bool { return len(rev.revoked()) >= len(want) }, 20*time.Second, 20*time.Millisecond,
			"revoked %v, want %v", rev.revoked(), want)
		assert.Equal(t, want, rev.revoked())
	}

	// Trigger 1: alice's RoleBinding goes.
	bindings, err := hub.Client.RbacV1().RoleBindings(fleetNS).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	i := slices.IndexFunc(bindings.Items, func(b rbacv1.RoleBinding) bool {
		return slices.Contains(b.Subjects, framework.ServiceAccountSubject(team, "alice"))
	})
	require.GreaterOrEqual(t, i, 0)
	require.NoError(t, hub.Client.RbacV1().RoleBindings(fleetNS).Delete(ctx, bindings.Items[i].Name, metav1.DeleteOptions{}))
	waitRevoked("JTI=alice")
	assert.ElementsMatch(t, []string{"JTI=bob", "JTI=carol"}, live())

	// Trigger 4: bob's hub ServiceAccount goes.
	require.NoError(t, hub.Client.CoreV1().ServiceAccounts(team).Delete(ctx, "bob", metav1.DeleteOptions{}))
	waitRevoked("JTI=alice", "JTI=bob")
	assert.Equal(t, []string{"JTI=carol"}, live())

	// Trigger 2: the ClusterProfile goes.
	require.NoError(t, hub.Inventory.ApisV1alpha1().ClusterProfiles(fleetNS).Delete(ctx, cp.Name, metav1.DeleteOptions{}))
	waitRevoked("JTI=alice", "JTI=bob", "JTI=carol")
	assert.Empty(t, live())
}
