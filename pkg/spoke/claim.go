package spoke

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Minting on a pooled grant (pool.go): the token is bound to a grant that
// names only its ServiceAccount, and Mint answers before the grant says
// whose the token is. The claim, one patch right after, writes the owner,
// the scope, the credential id and the expiry, on the condition that the
// grant is still the object that the agent bound the token to. If the
// claim fails, the agent deletes the grant, which revokes the
// token: no token lives unattributed. Until the claim lands, or after it
// failed until the grant is gone, the agent answers for the grant from
// memory: a revoke of its credential id deletes it, its deletion is told
// under that id, and only the claim the agent wrote is taken as the
// agent's.

// errPooledGone is the error of a mint whose pooled grant was deleted
// before its token was bound to it: Mint creates a grant instead.
var errPooledGone = errors.New("the pooled grant was deleted before the token was bound to it")

// pendingClaims holds, by grant UID, the grants a mint claimed whose claim the
// grant informer has not shown yet, as the claim writes them, and those
// whose claim failed until they are gone. Its zero value is ready.
type pendingClaims struct {
	mu sync.Mutex
	by map[types.UID]*corev1.Secret
}

func (c *pendingClaims) add(g *corev1.Secret) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.by == nil {
		c.by = map[types.UID]*corev1.Secret{}
	}
	c.by[g.UID] = g
}

func (c *pendingClaims) forget(uid types.UID) {
	c.take(uid)
}

// get returns the grant of UID uid as claimed, or nil.
func (c *pendingClaims) get(uid types.UID) *corev1.Secret {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.by[uid]
}

// take forgets the claim of the grant of UID uid, and returns the grant
// as claimed, or nil when there was none.
func (c *pendingClaims) take(uid types.UID) *corev1.Secret {
	c.mu.Lock()
	defer c.mu.Unlock()
	g := c.by[uid]
	delete(c.by, uid)
	return g
}

// ownClaim reports whether now carries the claim the agent wrote on it:
// every owner, scope and token annotation as the agent claimed it.
func (c *pendingClaims) ownClaim(now *corev1.Secret) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	want, ok := c.by[now.UID]
	if !ok {
		return false
	}
	for _, k := range claimedKeys {
		if now.Annotations[k] != want.Annotations[k] {
			return false
		}
	}
	return true
}

// with returns the claimed grants whose credential id is id.
func (c *pendingClaims) with(id string) []*corev1.Secret {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*corev1.Secret
	for _, g := range c.by {
		if g.Annotations[GrantCredentialIDAnnotation] == id {
			out = append(out, g)
		}
	}
	return out
}

// claimedKeys are the annotations a claim writes.
var claimedKeys = append(grantAnnotations[:len(grantAnnotations):len(grantAnnotations)],
	GrantCredentialIDAnnotation, GrantTokenSHA256Annotation)

// mintPooled mints the token of info's ServiceAccount, bound to grant, a
// pooled grant as the grant cache has it, and claims the grant for it once
// Mint has returned. It fails with errPooledGone when grant was deleted
// first. It ends the pool's count of grant as taken (grantPool.taken).
func (m *Minter) mintPooled(ctx context.Context, req *credbrokerv1alpha1.MintRequest, info grantInfo, grant *corev1.Secret, seconds int64) (mintedToken, error) {
	out, err := m.requestToken(ctx, req, info.serviceAccount, grant, seconds)
	if errors.Is(err, errBoundGrantGone) {
		m.pool.taken.Done()
		return mintedToken{}, errPooledGone
	}
	if err != nil {
		// A token may have been minted all the same (the answer was
		// lost): deleting the grant revokes it.
		m.deleteGrant(ctx, grant)
		m.pool.taken.Done()
		return mintedToken{}, err
	}
	tok := m.mintedOf(out, seconds)
	claimed := claimedGrant(grant, info, tok)
	m.claims.add(claimed)
	go func() {
		defer m.pool.taken.Done()
		m.claim(context.WithoutCancel(ctx), claimed, tok.exp)
	}()
	return tok, nil
}

// claimedGrant returns grant as its claim for tok, minted for info, writes
// it.
func claimedGrant(grant *corev1.Secret, info grantInfo, tok mintedToken) *corev1.Secret {
	claimed := grant.DeepCopy()
	info.expiration = tok.exp
	want := newGrant(info)
	claimed.Labels = maps.Clone(want.Labels)
	claimed.Annotations = maps.Clone(want.Annotations)
	sum := sha256.Sum256([]byte(tok.token))
	claimed.Annotations[GrantCredentialIDAnnotation] = tok.id
	claimed.Annotations[GrantTokenSHA256Annotation] = hex.EncodeToString(sum[:])
	if jti, ok := strings.CutPrefix(tok.id, "JTI="); ok && len(validation.IsValidLabelValue(jti)) == 0 {
		claimed.Labels[GrantJTILabel] = jti
	}
	return claimed
}

// claimPatch returns the merge patch that claims a pooled grant as claimed
// says, on the condition that it is still the object of claimed's UID: a
// Secret that replaced it under its name is not the token's.
func claimPatch(claimed *corev1.Secret) ([]byte, error) {
	b, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":         claimed.UID,
		"labels":      claimed.Labels,
		"annotations": claimed.Annotations,
	}})
	if err != nil {
		return nil, fmt.Errorf("encode grant claim: %w", err)
	}
	return b, nil
}

// claim writes claimed's claim onto its grant, which the token expiring
// at exp is bound to, and arranges the grant's deletion at exp. When the
// claim fails it deletes the grant, which revokes the token; if that fails
// too, a revoke of the token's credential id deletes it again, and the
// sweep collects it once its pooled expiry passes. Either way the brokers
// are told of the credential id's removal once the grant is gone.
func (m *Minter) claim(ctx context.Context, claimed *corev1.Secret, exp time.Time) {
	ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
	defer cancel()
	patch, err := claimPatch(claimed)
	if err == nil {
		err = m.grants.Patch(ctx, claimed.Namespace, claimed.Name, patch)
	}
	if err != nil {
		id := claimed.Annotations[GrantCredentialIDAnnotation]
		deleted := m.deleteGrant(ctx, claimed)
		m.log.Error(err, "failed to record a token's owner on its pooled grant; deleting the grant revokes the token",
			"grant", claimed.Namespace+"/"+claimed.Name, "credentialID", id, "deleted", deleted)
		// The grant never showed the credential id, so the brokers learn
		// of its removal from the claim kept in memory: here once it is
		// gone, or from its deletion event (GrantEvents). Until then a
		// revoke of the id finds the claim and deletes the grant again.
		if deleted && m.claims.take(claimed.UID) != nil {
			m.publishRemoved(id, m.expiration(claimed))
		}
		return
	}
	m.track(claimed, exp)
}
